"""`python -m nbmoe.sweep`: speed as the context fills (the program is nbmoe/cli/sweep.py)."""
from nbmoe.cli.sweep import main

if __name__ == "__main__":
    main()
