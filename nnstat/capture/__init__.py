"""nnstat.capture"""
