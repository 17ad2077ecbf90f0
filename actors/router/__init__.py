"""The Router: the one owner of the model catalog, provider credentials, providers and canonical receipts."""
