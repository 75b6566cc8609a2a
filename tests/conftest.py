import os

os.environ.setdefault("PYTHONWARNINGS", "ignore")
