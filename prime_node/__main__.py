from prime_node.cli.main import main

if __name__ == "__main__":  # guarded, so multiprocessing's spawn can import this module safely
    main()
