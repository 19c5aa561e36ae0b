"""nnstat.recorder"""
