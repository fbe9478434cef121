"""``torch.compile`` and training at scale: the backend (``backend``), one plan for every block,
rank and step (``block_plans``), the loss scaler that re-plans on overflow (``scaler``), FSDP2
sharding by the plan (``sharding``) and Hugging Face generation (``generation``).

Imports the stages below it (``graph``, ``precision``, ``capture``, ``passes``) and
``amprewrite.api``; nothing of ``deploy``, ``show`` or the command line.
"""
