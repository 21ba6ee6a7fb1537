"""The accelerator pool node: ``accelmig-pool``."""
