"""hotcold.sparse_ops"""
