"""What this machine and these options give: the serve preflight and ``duplexserve check``."""
