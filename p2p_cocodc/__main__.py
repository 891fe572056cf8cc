from p2p_cocodc.cli.main import main

main()
