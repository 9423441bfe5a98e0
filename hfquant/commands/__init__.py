"""Layer 7, the `hfquant` command line only (argparse): `cli` builds the parser and maps errors to exit statuses, one
module per subcommand adds its parser and runs it over the library (`hfquant.conversion`, `hfquant.inspection`,
`hfquant.verification`, `hfquant.evaluation`, `hfquant.publishing`), `options` turns the quantization options into
an `HfQuantConfig`. Nothing in the package imports it."""
