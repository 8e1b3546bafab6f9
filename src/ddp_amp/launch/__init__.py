"""Launchers: each ends in N processes with the standard environment contract calling ddp_amp.worker."""
