"""gqa-lab training: the loop, conversions and the commands.

  python -m train.main     train (configs/, --config=NAME)
  python -m train.sample   generate text from a workdir
  python -m train.convert  a checkpoint with fewer K/V heads, into MLA or GTA,
                           from or to Hugging Face (train/convert/)
  python -m train.prepare_data  a corpus tokenized once into token shards
"""
