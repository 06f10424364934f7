"""The expression language of pipeline specs (`fields`, `where`, aggregate arguments).

Text is parsed by a lark LALR grammar (`parsing`) into a small tree of frozen dataclasses
(`tree`), typed against a scope of field types (`checking`), and compiled into Spark `Column`s
built with `pyspark.sql.functions` only (`columns`): spec text is never pasted into SQL nor
evaluated. The language is described in docs/streams.md (#expressions); pyspark is imported only
by `columns.to_column`, so specs load without it.
"""
