"""A small billing app: the project whose tests examples/testing/tests are."""
