"""`python -m nbmoe.bench`: the benchmark's entry point (the program is nbmoe/cli/bench.py)."""
from nbmoe.cli.bench import main

if __name__ == "__main__":
    main()
