"""nnstat.statistics"""
