"""redist inside other libraries: adapters that route their resharding through redist.

Importing a module here changes nothing; each says how to switch its library over (one call).
"""
