import sys
from pathlib import Path

# Lets benchmark files import the shared `scenarios` module.
sys.path.insert(0, str(Path(__file__).parent))
