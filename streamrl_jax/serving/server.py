"""Running the OpenAI-compatible server: uvicorn on a thread of its own (`ServerThread`, inside a sampler or a test)
or in the foreground (`streamrl serve`), and the loop that owns a standalone server's sampler (`GenerationLoop`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import threading
from concurrent.futures import Future

import uvicorn

from streamrl_jax.serving.app import Service, make_app
from streamrl_jax.serving.bridge import RequestBridge

_log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0


def bind(host: str, port: int) -> socket.socket:
  """A listening socket on (host, port); port 0 takes a free one."""
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((host, port))
  except OSError as err:
    sock.close()
    raise OSError(f"cannot listen on {host}:{port}: {err.strerror}") from None
  sock.listen(2048)
  return sock


def uvicorn_config(service: Service, tls=None) -> uvicorn.Config:
  """uvicorn's configuration for `service`; with `tls` (a `TLSFiles`), mutual TLS: clients need a certificate
  signed by its CA."""
  options = {}
  if tls is not None:
    tls.read()  # a missing file: one line naming its flag
    options = dict(ssl_certfile=tls.cert, ssl_keyfile=tls.key, ssl_ca_certs=tls.ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
  return uvicorn.Config(make_app(service), log_level="warning", access_log=False, timeout_graceful_shutdown=2,
                        limit_concurrency=None, lifespan="off", **options)


class ServerThread:
  """The server on a daemon thread with its own event loop. `call(fn, *args)` runs `fn` on that loop (the one
  thread that touches the service) and returns its result."""

  def __init__(self, service: Service, *, tls=None):
    self.service = service
    self._sock = bind(service.config.host, service.config.port)
    self.port = self._sock.getsockname()[1]
    self.scheme = "https" if tls is not None else "http"
    self._server = uvicorn.Server(uvicorn_config(service, tls))
    self._loop: asyncio.AbstractEventLoop | None = None
    self._ready = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True, name="openai-server")
    self._thread.start()
    if not self._ready.wait(START_TIMEOUT_S) or not self._server.started:
      self.stop()
      raise RuntimeError(f"the OpenAI-compatible server did not start within {START_TIMEOUT_S:.0f} s")

  @property
  def base_url(self) -> str:
    host = self.service.config.host
    host = "127.0.0.1" if host in ("0.0.0.0", "") else (f"[{host}]" if ":" in host else host)
    return f"{self.scheme}://{host}:{self.port}/v1"

  def _run(self) -> None:
    self._loop = asyncio.new_event_loop()
    asyncio.set_event_loop(self._loop)

    async def main():
      serving = asyncio.ensure_future(self._server.serve(sockets=[self._sock]))
      while not self._server.started and not serving.done():
        await asyncio.sleep(0.01)
      self._ready.set()
      await serving
    try:
      self._loop.run_until_complete(main())
    finally:
      self._ready.set()
      self._loop.close()

  def call(self, fn, *args, timeout: float = 10.0):
    """`fn(*args)` on the server's event loop; its result (or exception)."""
    future: Future = Future()

    def run():
      try:
        future.set_result(fn(*args))
      except BaseException as err:  # noqa: BLE001 - handed to the caller
        future.set_exception(err)
    self._loop.call_soon_threadsafe(run)
    return future.result(timeout)

  def stop(self) -> None:
    self._server.should_exit = True
    self._thread.join(timeout=10)
    self._sock.close()


class GenerationLoop:
  """The thread that owns a standalone server's `StreamingSampler`: takes served requests in, decodes while any
  runs, sends their tokens out; idle, it waits for the next request."""

  def __init__(self, sampler, bridge: RequestBridge):
    self.sampler, self.bridge = sampler, bridge
    self._stop = threading.Event()
    self._going = threading.Event()
    self._going.set()
    self.error: BaseException | None = None
    self._thread = threading.Thread(target=self._run, daemon=True, name="generation")
    self._thread.start()

  def _run(self) -> None:
    sampler, bridge = self.sampler, self.bridge
    try:
      while not self._stop.is_set():
        self._going.wait()
        bridge.pump(sampler)
        if sampler.has_work():
          bridge.deliver(sampler, sampler.step())
        else:
          bridge.wait(0.5)
    except BaseException as err:  # noqa: BLE001 - the server answers 503 from here on, the error is logged
      self.error = err
      _log.error(f"the generation loop stopped: {type(err).__name__}: {err}")
    finally:  # an error ends the server's service; a stop only this loop's (another may take the sampler on)
      message = "the server's generation loop has stopped"
      bridge.close(sampler, message) if self.error is not None else bridge.refuse_all(sampler, message)

  @contextlib.contextmanager
  def held(self):
    """Holds the loop between two steps while inside (requests wait in the bridge, none finishes): maintenance, and
    tests that need requests to stay in flight."""
    self._going.clear()
    try:
      yield
    finally:
      self._going.set()

  def stop(self) -> None:
    self._stop.set()
    self._going.set()
    self.bridge.post_wake()
    self._thread.join(timeout=30)
