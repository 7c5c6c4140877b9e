"""`python -m nbmoe.compile`: compile a model's kernels ahead (the program is nbmoe/cli/compile.py)."""
from nbmoe.cli.compile import main

if __name__ == "__main__":
    main()
