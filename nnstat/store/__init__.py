"""nnstat.store"""
