"""Every route of every edge, in one table (``table.ROUTES``); the types they share are in ``route``."""
