"""The local stack's replicas (`duality serve`, docs/serving.md): this host's `duality serve`
of every spec (`duality.serve.control`), on the loopback address, on a port it keeps, started
by `duality up` and stopped by `duality down`."""

from __future__ import annotations

import dataclasses

from duality.config import PREFIX, Settings
from duality.local.ports import free_port, port_in_use
from duality.local.startup import wait_started
from duality.serve import control
from duality.serve.control import ServingStatus, ServingStopped


class LocalServing:
    """This host's `duality serve`, in `settings.replica_dir`."""

    def __init__(self, settings: Settings):
        self.settings = settings

    def port(self) -> int:
        """The port it last ran on (clients know it), else the settings' if free, else a free
        one."""
        known = control.port_on_file(self.settings)
        if known is not None:
            return known
        wanted = self.settings.serve_port
        if wanted and not port_in_use("127.0.0.1", wanted):
            return wanted
        return free_port()

    def client_settings(self, port: int) -> dict[str, str]:
        """The settings by which `duality query` (and the stream DAG's supervisor) find it."""
        return {
            f"{PREFIX}SERVE_PORT": str(port),
            f"{PREFIX}REPLICAS": f"http://127.0.0.1:{port}",
        }

    def status(self) -> ServingStatus:
        return control.status(self.settings)

    def start(self, timeout: float = 120.0) -> ServingStatus:
        """Start it unless it runs; wait until its API answers `/healthz`."""
        if control.pid(self.settings) is not None:
            return dataclasses.replace(self.status(), already_running=True)
        port = self.port()
        process = control.launch(self.settings, port)
        wait_started(
            {"duality serve": process},
            [self.status().log],
            lambda: self.status().healthy,
            failure=f"duality serve did not answer /healthz on port {port}",
            timeout=timeout,
            stop=self.stop,
        )
        return dataclasses.replace(self.status(), already_running=False)

    def stop(self) -> ServingStopped:
        return control.stop(self.settings)
