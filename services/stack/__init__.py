"""`rankscope up`: everything on this machine, supervised as one stack."""
