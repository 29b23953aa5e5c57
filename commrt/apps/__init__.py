"""The programs behind the entry folders of the repository (``servers/``, ``workers/``) and the
``commrt server`` command: argument parsing and a main() over the public API. They live in the
package so that an installed commrt has them without installing generic top-level names."""
