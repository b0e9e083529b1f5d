"""hotcold.predictors"""
