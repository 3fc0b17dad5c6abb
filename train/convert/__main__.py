"""`python -m train.convert`: see train/convert/workdirs.py."""

from train.convert import workdirs

workdirs.run()
