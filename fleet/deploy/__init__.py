"""``fleet deploy``: run the host deploys (``fleet.operations.host``) through pyinfra's API."""
