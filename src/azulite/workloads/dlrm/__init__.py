"""TorchRec's DLRM on Criteo-format data: the model factory (``model``), sharding and memory planning
(``sharding``), and the pieces of the training loop (``loop``). ``examples/dlrm/train.py`` assembles them."""
