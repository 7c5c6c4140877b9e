"""The command-line programs: chat REPL, bench, and what they share."""
