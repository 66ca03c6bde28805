"""How the package's log lines look on a server's stderr: ``llm_api serve`` sets it on the root logger
(``server.cli``), and each Ray Serve replica and ingress on the package's logger (``scale_out.deployments``),
so a line reads the same from every process."""

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
