from p2p_cocodc.cli import main

main()
