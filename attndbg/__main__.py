from attndbg.cli import main

main()
