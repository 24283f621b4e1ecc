"""The core: rules, tables, the walker, the splicer and the dispatcher."""
