"""eyas.heads"""
