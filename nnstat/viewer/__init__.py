"""nnstat.viewer"""
