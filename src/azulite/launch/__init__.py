"""azulite.launch"""
