from .repl import main

main()
