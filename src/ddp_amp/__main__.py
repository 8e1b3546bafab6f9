from ddp_amp.cli import main

main()
