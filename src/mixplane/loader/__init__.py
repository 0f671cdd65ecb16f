"""The Source Loader: reads one source's Parquet pages in place, shuffles, transforms and ships planned samples."""
