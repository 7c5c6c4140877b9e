from nbmoe.cli.chat import main

main()
