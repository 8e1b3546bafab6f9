"""What a run left behind, read and shown: runs (show), the ranks' flight records (diagnose, the launcher's
failure line), and the report tables and plots."""
