"""Training data formats: readers, converters and synthetic generators (``azulite.data.criteo``)."""
