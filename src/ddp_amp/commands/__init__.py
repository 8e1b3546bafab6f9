"""The commands, one module per family, each thin: parse, build a config, call one function (cli.py registers
them): train (spawn, run, multinode), bench, doctor, inspect (show, diagnose, env); options holds what they
share."""
