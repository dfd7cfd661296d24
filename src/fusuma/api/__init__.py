"""fusuma serve: the host's REST API daemon."""
