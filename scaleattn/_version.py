"""The package version (layer L0): the one place it is written; modules import it from here, never from the
package root."""
__version__ = "0.1.0"
