"""Entry point of the picture process (``python -m podmonitor.reporting._render_child``); see
:mod:`podmonitor.reporting.render_process`. Nothing imports this module."""

from podmonitor.reporting.render_process import serve

if __name__ == "__main__":
    serve()
