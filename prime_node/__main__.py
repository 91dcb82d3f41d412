from prime_node.cli.main import main

main()
