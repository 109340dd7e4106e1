"""Reference models and training programs. Each model is built by an importable factory, so a checkpoint's
manifest can name it (``model_config.factory``) and ``azulite export`` can rebuild it from files alone."""
