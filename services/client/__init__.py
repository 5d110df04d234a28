"""Command-line clients of the gateway: `rankscope timeline`, `placement`, `diagnose`,
`ranktable`, `runners`."""
