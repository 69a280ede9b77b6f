"""The frozen target model: loading it (`load`) and the features a draft head reads from it
(`features`). Data, train and eval use it; it uses no stage."""
