"""gqa-lab training: the language model, its data, the loop and the commands.

  python -m train.main     train (configs/, --config=NAME)
  python -m train.sample   generate text from a workdir
  python -m train.convert  a checkpoint with fewer K/V heads
  python -m train.prepare_data  a corpus tokenized once into token shards
"""
