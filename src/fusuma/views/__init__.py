"""Read models: what ``--json`` prints and the API returns, one module per topic, read
fresh from the state file and the kernel. The CLI renders them as text or JSON, the API
returns them; both take them from here."""
