"""nnstat.influence"""
