"""jinja2 templates of accelerator-ready domain XML (rendered by ``accelmig domain render``)."""
