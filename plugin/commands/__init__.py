"""One module per ``accelmig`` command (imported lazily by accelmig.plugin.cli)."""
